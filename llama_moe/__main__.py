"""`python -m llama_moe`: the `llama-moe` command."""

import sys

from .commands import main

sys.exit(main())
