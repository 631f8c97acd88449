"""The Flower layer: the ServerApp (rounds, then phases), the ClientApp, the strategy, the
server-side phases and the client-side handlers. Kept thin: the math lives below."""
