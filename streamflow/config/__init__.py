"""Typed configuration of a run: every knob of a run declared, defaulted and checked once.

Owns nothing itself; it is the one import point (``from streamflow.config import RunConfig, ...``)
of its modules:

- ``sections``: the frozen dataclass of each YAML section, with its defaults and range checks; the
  ``rollout`` and ``trainer`` sections embed the workers' settings objects (``workers.settings``),
  whose fields are flat keys of the section (``trainer.lr``, ``rollout.temperature``);
- ``run``: ``RunConfig``, the cross-section rules, ``load_config`` and ``dump_yaml``;
- ``convert``: the one generic converter (types, nested and embedded dataclasses), the safe YAML
  loader, ``key.sub=value`` overrides and the errors.

Invariants:
- YAML only *fills values*: files are read with a safe loader (no tags, no eval, no
  interpolation, duplicate keys rejected). The only substitution is ``{name}`` in
  ``run.output_dir``, replaced by ``run.name``.
- A ``RunConfig`` that exists is valid, however it was built: each section (and settings object)
  checks its ranges on construction, ``RunConfig`` the cross-field rules.
- Every bad input raises a ``ConfigError`` subclass whose one-line message names the full key
  (``trainer.lr``), what was expected and what was given; unknown keys list the allowed keys
  and a "did you mean" suggestion.
"""

from streamflow.config.convert import (
    ConfigError,
    ConfigTypeError,
    ConfigValueError,
    OverrideSyntaxError,
    UnknownKeyError,
    from_dict,
    to_dict,
)
from streamflow.config.run import (
    RunConfig,
    config_from_dict,
    config_to_dict,
    config_warnings,
    dump_yaml,
    load_config,
)
from streamflow.config.sections import (
    DataSection,
    DevicesSection,
    MetricsSection,
    ModelSection,
    PlacementNode,
    PlacementSection,
    ReferenceSection,
    RewardSection,
    RolloutSection,
    RunSection,
    SimulatedSection,
    StoreSection,
    TinyModelConfig,
    TrainerSection,
    WeightsSection,
)

__all__ = [
    "ConfigError", "ConfigTypeError", "ConfigValueError", "DataSection", "DevicesSection",
    "MetricsSection", "ModelSection", "OverrideSyntaxError", "PlacementNode", "PlacementSection",
    "ReferenceSection", "RewardSection", "RolloutSection", "RunConfig", "RunSection",
    "SimulatedSection", "StoreSection", "TinyModelConfig", "TrainerSection", "UnknownKeyError",
    "WeightsSection", "config_from_dict", "config_to_dict", "config_warnings", "dump_yaml",
    "from_dict", "load_config", "to_dict",
]
