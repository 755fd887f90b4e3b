"""The adapter registry: versions, aliases with promote and rollback, and what the fleet's engines loaded."""
