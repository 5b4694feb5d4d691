"""The built-in scheduling policies, registered like plugins (entry points in pyproject.toml)."""
