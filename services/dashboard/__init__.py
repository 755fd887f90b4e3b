"""The dashboard: a static page that talks to NATS over WebSocket, and the small server that hands it out."""
