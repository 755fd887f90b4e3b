"""jetlora's wire contract: every message is a msgspec Struct, every name is in `names`."""
