"""The k3c error hierarchy.

Every error a user can cause (a bad config, checkpoint, artifact or option) is raised as one of these and caught
once, in the CLI, where it is printed as a single line. Anything else escaping is a bug in k3c.
"""


def shown(value) -> str:
    """repr(`value`) as an error message quotes it, cut to 60 characters (a 10**400 or a long list stays one
    readable line)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class K3CError(Exception):
    """Base of every error k3c raises on purpose."""


class ConfigError(K3CError):
    """A model config (config.json, preset or option) is missing a field or has a wrong value."""


class CheckpointError(K3CError):
    """A checkpoint directory has a missing, extra, mis-shaped or non-finite tensor."""


class ArtifactError(K3CError):
    """An artifact is missing files, fails its hashes, or comes from an unsupported format version."""


class UnsupportedError(K3CError):
    """The input is valid but uses something k3c does not implement (an op, a dtype, a target)."""


class IRError(K3CError):
    """A graph fails verification: a type does not match inference, a value is used before it is defined, ..."""


class RuntimeInputError(K3CError):
    """A runtime call got bad input: tokens out of vocabulary, batch or context beyond the compiled bounds."""
