"""Quality: perplexity and answers of conversions, routers, healing and sparsity, and the references beside them."""
