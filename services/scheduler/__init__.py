"""The scheduler: validates and stores jobs, tracks nodes by heartbeat, places jobs on free devices."""
