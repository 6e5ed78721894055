"""What a server shares to serve and a client to call it: auth, the interceptor, the server, channels, errors."""
