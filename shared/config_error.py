"""A bad setting, named: what every validation of config raises, before anything starts."""


class ConfigError(ValueError):
    pass
