"""What `pagedserve` runs beside the four services: `up` (embedded Redis, child supervision),
`generate` (one prompt, in-process) and `healthcheck` (for container healthchecks)."""
