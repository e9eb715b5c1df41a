"""One module per `clover` subcommand (listed in clover_jax/cli.py), plus the helpers two of them use:
`jobs` (resumable JSONL batch jobs) and `model_card` (the card `clover train --export` writes)."""
