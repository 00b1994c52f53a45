"""`python -m llama_moe_hf`: the `llama-moe` command (the installed `llama-moe` starts faster: see llama_moe_cli)."""

import sys

from .commands import main

sys.exit(main())
