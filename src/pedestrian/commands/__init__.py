"""One module per ``pedestrian`` subcommand: ``add_arguments(parser)`` and ``run(args) -> int``.
They parse arguments and print; the work is the library's (text/, model/, generation/, paper/,
training/, interop/)."""
