"""The two media: a host-memory arena and SSD session files; and the reclaim policy."""
