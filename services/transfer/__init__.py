"""Shared plumbing for the object stores: the chunk protocol's client side (sending a file to the artifact service,
fetching an object verified) and the read side of the datasets bucket. Any service or client may use it; it
imports no service."""
