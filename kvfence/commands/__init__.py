"""One module per `kvfence` subcommand; each exposes `register(subparsers)`."""
