"""How every OpenTinker process runs and talks, shared by the servers (and, for channels and errors, the SDK).

One way to start a server (`server.run_server`), one error model (`errors`), one auth model (`auth`),
one interceptor that applies both and records metrics (`interceptor`), one way to open a channel with its
TLS credentials and bearer header (`channel`), the servers' calls to the registry (`registry_link`).
"""
