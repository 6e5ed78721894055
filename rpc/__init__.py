"""gRPC server scaffolding shared by the registry, trainer and sampler servers.

One way to start a server (`server.run_server`), one error model (`errors`), one auth model (`auth`),
one interceptor that applies both and records metrics (`interceptor`).
"""
