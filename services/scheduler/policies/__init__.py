"""The built-in scheduling policies, each registered under the entry-point group
`pagedserve.policies` in pyproject.toml exactly as a third-party plugin would be."""
