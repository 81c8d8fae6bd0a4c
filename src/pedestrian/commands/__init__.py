"""One module per ``pedestrian`` subcommand: ``add_arguments(parser)`` and ``run(args) -> int``."""
