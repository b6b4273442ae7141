"""One module per `tailspec` command group; each exposes register(subparsers)."""
