"""The plumbing of a server process: flags and config files, start-up failures, locks, children, heap, faults."""
