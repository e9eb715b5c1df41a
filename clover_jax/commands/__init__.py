"""One module per `clover` subcommand (see clover_jax/cli.py)."""
