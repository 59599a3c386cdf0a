"""The one error type that user-facing input problems raise.

Entry points catch it, print its one line and exit with status 2, so a bad
config key, flag or file never produces a traceback or touches the workdir.
"""


class ConfigError(ValueError):
  """Invalid user input. `key` names the config key, flag or file at fault."""

  def __init__(self, key: str, message: str | None = None):
    if message is None:
      # Re-raised by a library from its one-string form ("key: message").
      key, _, message = key.partition(': ')
    self.key = key
    self.message = message
    super().__init__(f'{key}: {message}')
