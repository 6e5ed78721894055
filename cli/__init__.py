"""The `opentinker` command line: the composition root that wires every server's CLI and the SDK-based tools."""
