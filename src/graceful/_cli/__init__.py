"""``graceful run``: the command line, the servers it runs, its ``--workers`` parent."""
