"""The node agent: heartbeats with its devices, runs assigned jobs' trainers, ships their artifacts."""
