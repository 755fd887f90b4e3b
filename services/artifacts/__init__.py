"""Artifacts: chunked uploads into the JetStream object store, and the operators' queries."""
