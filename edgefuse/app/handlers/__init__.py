"""Client-side handlers of the ClientApp's messages."""
