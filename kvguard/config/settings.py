"""kvguard settings: pydantic sections, loaded from an optional TOML/JSON file plus ``KVGUARD_*`` env.

Precedence (last wins): defaults < file < environment < overrides. The file is the ``path``
argument, else the file named by ``KVGUARD_CONFIG``. Environment variables name a field by its
path with ``__`` between levels, pydantic-settings' nested delimiter: ``KVGUARD_KAFKA__LINGER_MS=5``,
``KVGUARD_TOPICS__EVENTS__PARTITIONS=12``. A value for a list, dict or section field is parsed as
JSON (``KVGUARD_KAFKA__PRODUCER_OPTIONS='{"metadata_max_age_ms": 1000}'``); any other value is a
string that pydantic converts (``"true"``, ``"5"``, ``"0.5"``). ``KVGUARD_*`` names without ``__``
(like ``KVGUARD_CONFIG``) are not settings and are ignored here.

``Settings(...)`` is its arguments over the defaults and nothing ambient, so code and tests that
build settings by hand do not change with the shell they run in; ``Settings.load`` adds the file
and the environment (pydantic-settings' TOML, JSON and env sources).

Every section forbids unknown keys, so a typo in a file or an env name is an error, not a silent
default. Bad config raises ``ConfigError`` whose message names the field path and the source,
e.g. ``kafka.linger_ms: must be ≥ 0 (from env KVGUARD_KAFKA__LINGER_MS)``.

To add a field: add it (with a default and a bound) to its section class below; to add a
section: add a ``_Section`` subclass and a field on ``Settings``.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    JsonConfigSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from kvguard.contracts.node_id import node_id_problem

ENV_PREFIX = "KVGUARD_"
ENV_CONFIG_FILE = "KVGUARD_CONFIG"
TOPIC_KINDS: tuple[str, ...] = ("events", "metrics", "alerts", "commands", "acks", "dlq")


class ConfigError(ValueError):
    """A configuration value is wrong. ``field`` is the dotted path (``kafka.linger_ms``)."""

    def __init__(self, field: str, problem: str, source: str | None = None):
        self.field = field
        self.problem = problem
        self.source = source
        where = f" (from {source})" if source else ""
        super().__init__(f"{field}: {problem}{where}")


_SECRET_WORDS = ("password", "secret", "token")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def __repr_args__(self):
        """``repr``/``str`` never show a secret: secret fields are ``repr=False``; secret-looking
        keys of option dicts and the password of a URL are masked here."""
        for name, value in super().__repr_args__():
            if isinstance(value, dict):
                value = {k: "***" if any(w in str(k).lower() for w in _SECRET_WORDS) else v for k, v in value.items()}
            elif isinstance(value, str) and "://" in value and "@" in value:
                value = _mask_url(value)
            yield name, value


def _mask_url(url: str) -> str:
    """``redis://user:pw@host`` -> ``redis://user:***@host``."""
    scheme, _, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not at:
        return url
    user, colon, _ = userinfo.partition(":")
    return f"{scheme}://{user}{':***' if colon else ''}@{host}" if colon else f"{scheme}://***@{host}"


class KafkaSettings(_Section):
    bootstrap: str = "127.0.0.1:9092"
    client_id: str = "kvguard"
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] | None = None
    sasl_username: str | None = None
    sasl_password: str | None = Field(None, repr=False)
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    linger_ms: int = Field(5, ge=0)
    max_batch_bytes: int = Field(1_048_576, gt=0)
    # the broker's limit on one record (Kafka's message.max.bytes, aiokafka's max_request_size):
    # the node publisher splits an event batch that would not fit
    max_message_bytes: int = Field(1_048_576, gt=0)
    # records accepted by publish() but not yet acknowledged by the broker; publish() waits
    # (backpressure) at this bound and refuses, counted as dropped, after send_buffer_timeout_s
    send_buffer_records: int = Field(100_000, gt=0)
    send_buffer_timeout_s: float = Field(30.0, ge=0)
    request_timeout_ms: int = Field(40_000, gt=0)
    # Tansu 0.6 answers InitProducerId with an error, so an idempotent producer never gets going
    # there; turn it on against Apache Kafka / Redpanda
    idempotent: bool = False
    acks: Literal["0", "1", "all"] = "all"
    compression: Literal["gzip", "snappy", "lz4", "zstd"] | None = None
    session_timeout_ms: int = Field(10_000, gt=0)
    # longest a consumer's fetch waits at the broker for data. Tansu 0.6 holds a fetch for the full
    # wait even when records arrive meanwhile, so this bounds each consumer hop of the decision
    # latency (docs/ARCHITECTURE.md, "Targets"). Read by the Faust worker (Faust alone would use 1500 ms);
    # consumer_options["fetch_max_wait_ms"], when given, wins
    fetch_max_wait_ms: int = Field(50, gt=0)
    heartbeat_interval_ms: int = Field(3_000, gt=0)
    # anything else aiokafka accepts, passed through unchanged (AIOKafkaProducer / AIOKafkaConsumer
    # keyword arguments, e.g. {"metadata_max_age_ms": 5000}); they win over the fields above
    producer_options: dict[str, Any] = Field(default_factory=dict)
    consumer_options: dict[str, Any] = Field(default_factory=dict)


class TopicSpec(_Section):
    name: str = Field(min_length=1)
    partitions: int = Field(6, gt=0)
    replication_factor: int = Field(1, gt=0)
    retention_ms: int = Field(7 * 24 * 3600 * 1000, ge=-1)


def _topic(name: str, partitions: int = 6, retention_h: int = 24 * 7) -> Any:
    return Field(
        default_factory=lambda: TopicSpec(
            name=name, partitions=partitions, retention_ms=retention_h * 3600 * 1000
        )
    )


class TopicsSettings(_Section):
    """Topic names are ``prefix + spec.name`` (``kvguard.events``)."""

    prefix: str = "kvguard."
    events: TopicSpec = _topic("events", 12, 24)
    metrics: TopicSpec = _topic("metrics", 6, 24 * 7)
    alerts: TopicSpec = _topic("alerts", 3, 24 * 30)
    commands: TopicSpec = _topic("commands", 6, 24)
    acks: TopicSpec = _topic("acks", 6, 24 * 7)
    dlq: TopicSpec = _topic("dlq", 3, 24 * 30)

    @model_validator(mode="before")
    @classmethod
    def _fill_from_defaults(cls, data: Any) -> Any:
        # a partial spec ({"partitions": 3}) keeps the kind's other defaults (its name above all)
        if not isinstance(data, Mapping):
            return data
        merged = dict(data)
        for kind in TOPIC_KINDS:
            given = merged.get(kind)
            if isinstance(given, Mapping):
                default = cls.model_fields[kind].default_factory().model_dump()
                merged[kind] = {**default, **given}
        return merged

    def name(self, kind: str) -> str:
        """Full topic name of one kind: ``name("events") -> "kvguard.events"``."""
        return self.prefix + self.spec(kind).name

    def spec(self, kind: str) -> TopicSpec:
        if kind not in TOPIC_KINDS:
            raise KeyError(f"unknown topic kind {kind!r}; expected one of {', '.join(TOPIC_KINDS)}")
        return getattr(self, kind)

    def all(self) -> dict[str, TopicSpec]:
        """Full name -> spec, for every topic kvguard uses."""
        return {self.name(kind): self.spec(kind) for kind in TOPIC_KINDS}


class RedisSettings(_Section):
    url: str = "redis://127.0.0.1:6379/0"
    password: str | None = Field(None, repr=False)
    tls: bool = False
    ssl_cafile: str | None = None


class StreamsSettings(_Section):
    tick_s: float = Field(10.0, gt=0)
    alpha: float = Field(2.0, ge=0)
    beta: float = Field(1.0, ge=0)
    reserved_frac: float = Field(0.05, ge=0, lt=1)
    slope_window_s: float = Field(300.0, gt=0)
    # tier 1 (docs/ARCHITECTURE.md, "Alerts and prediction"): threshold
    u_kv_warning: float = Field(0.88, ge=0, le=1)
    u_kv_critical: float = Field(0.90, ge=0, le=1)
    psi_critical: float = Field(0.95, ge=0)
    threshold_for_s: float = Field(0.0, ge=0)
    # tier 2: slope and the KVCacheOOMRisk fragmentation rule
    slope_per_min: float = Field(0.05, ge=0)
    slope_for_s: float = Field(0.0, ge=0)
    frag_u_kv: float = Field(0.88, ge=0, le=1)
    frag_f_ext: float = Field(0.5, ge=0, le=1)
    frag_for_s: float = Field(120.0, ge=0)
    # tier 3: LSTM
    lstm_for_s: float = Field(0.0, ge=0)
    resolve_for_s: float = Field(30.0, ge=0)
    # Faust worker (streams/app.py), decision latency (docs/ARCHITECTURE.md, "Targets"): the agent handles records in
    # chunks of up to chunk_max_records, waiting at most chunk_max_wait_s to fill one
    chunk_max_records: int = Field(1000, gt=0)
    chunk_max_wait_s: float = Field(0.01, gt=0)
    # hostile input (kvguard.wire.validate, streams.core): caps on one record, epoch jumps, and
    # per-node state (past max_nodes the least recently seen node is evicted; a node idle for
    # node_idle_timeout_s of wall time is evicted by the worker)
    max_batch_events: int = Field(1 << 20, gt=0)
    max_dynamic_units: int = Field(1 << 24, gt=0)
    max_state_refs: int = Field(1 << 22, gt=0)
    max_epoch_jump: int = Field(1 << 61, gt=0)
    # a node's event time jumping further past its clock is dead-lettered until a later batch confirms it
    max_ts_skew_s: float = Field(3600.0, gt=0)
    # an event further behind its node's clock is applied all the same and counted in the open tick's
    # late_events (null: one tick, tick_s)
    max_ts_backwards_s: float | None = Field(None, ge=0)
    max_nodes: int = Field(10_000, gt=0)
    node_idle_timeout_s: float = Field(3600.0, gt=0)
    # the Faust worker publishes the pending (partial) tick of a node without batches for this
    # long in wall time, so a dying node's last interval is not lost; null: two ticks (2 * tick_s)
    idle_flush_s: float | None = Field(None, gt=0)


class PredictorSettings(_Section):
    # tier 3 (P(OOM)) on by default, with the shipped model unless model_path names another artifact;
    # false: no predictor (a command's --no-predictor does the same)
    enabled: bool = True
    model_path: str | None = None
    # tier 3's operating threshold; null: the model's own calibrated threshold, from its metadata (a
    # number here replaces it, also in a file that spells out every field)
    threshold: float | None = Field(None, ge=0, le=1)
    window_s: float = Field(1800.0, gt=0)
    horizon_s: float = Field(300.0, gt=0)


class PolicySettings(_Section):
    preset: Literal["default", "emergency"] = "default"
    hmac_secret: str = Field("", repr=False)
    command_ttl_s: float = Field(30.0, gt=0)
    async_scan_s: float = Field(30.0, gt=0)
    # per-preset strategy overrides ({"selection": "priority", "threshold": 0.8}); checked by
    # policy.strategy.strategy_from_mapping, which names the bad field as policy.default.<field>
    default: dict[str, Any] = Field(default_factory=dict)
    emergency: dict[str, Any] = Field(default_factory=dict)
    # per-node state of the policy engine: at most max_nodes nodes (least recently seen evicted),
    # a node without ticks for node_idle_timeout_s of wall time evicted; a tick whose epoch jumps
    # more than max_epoch_jump past its node's is dead-lettered, not taken as a restart
    max_nodes: int = Field(10_000, gt=0)
    node_idle_timeout_s: float = Field(3600.0, gt=0)
    max_epoch_jump: int = Field(1 << 61, gt=0)


class CanarySettings(_Section):
    """Canary rollout of a strategy variant (kvguard.policy.canary; docs/ARCHITECTURE.md, "Canary
    rollout"). Off by default. ``candidate``: a preset (default|emergency), a grid index (0..242)
    or a variant (``request/cost/async/recompute/hard``); it replaces the strategy of ``mode`` on
    the nodes whose bucket (SHA-256 of the node id mod 100) is below the stage's percentage."""

    enabled: bool = False
    candidate: str = Field("", validate_default=True)
    mode: Literal["default", "emergency"] = "default"
    stages: list[int] = Field(default_factory=lambda: [5, 25, 50, 100])
    # a stage is judged once both arms have this many node-hours in it
    min_node_hours: float = Field(50.0, gt=0)
    # roll back when the candidate's OOMs per node-hour exceed the control's times this factor
    oom_rate_factor: float = Field(1.5, gt=0)
    # ... or its evicted-request completion rate falls below the control's minus this margin
    # (judged only when both arms have min_resolved_evictions resolved evictions in the stage)
    completion_margin: float = Field(0.05, ge=0, le=1)
    min_resolved_evictions: int = Field(20, ge=0)
    evaluate_every_s: float = Field(60.0, gt=0)  # of event time
    # the rollout's key in the SLO ledger; empty: "<candidate variant>~<control variant>"
    rollout_id: str = Field("", pattern=r"^[^{}|]*$")

    @field_validator("candidate")
    @classmethod
    def _candidate_when_enabled(cls, value: str, info: ValidationInfo) -> str:
        if info.data.get("enabled") and not value.strip():
            raise ValueError("must name the candidate strategy when canary.enabled is true")
        return value

    @field_validator("stages")
    @classmethod
    def _stages_rise_to_100(cls, value: list[int]) -> list[int]:
        if not value or any(not 0 < p <= 100 for p in value) or value != sorted(set(value)) or value[-1] != 100:
            raise ValueError("must be increasing percentages in 1..100 ending at 100, e.g. [5, 25, 50, 100]")
        return value


class BudgetSettings(_Section):
    minutes_per_week: float = Field(60.0, gt=0)
    f_ext_threshold: float = Field(0.5, ge=0, le=1)
    retention_weeks: int = Field(8, gt=0)
    key_prefix: str = "kvguard:"
    cluster: str = "default"
    # width of the burn buckets reported when a budget is exhausted
    interval_s: int = Field(3600, gt=0)
    top_intervals: int = Field(5, gt=0)
    # debits held in memory while Redis is unreachable
    buffer_max: int = Field(100_000, gt=0)


class NodeSettings(_Section):
    # the GPU's id on every record (kvguard.contracts.node_id: 63 characters of letters, digits, -_./:)
    node_id: str | None = None
    # how often the node publisher drains the pool: part of every decision's latency
    flush_interval_s: float = Field(0.1, gt=0)
    max_batch_events: int = Field(65_536, gt=0)
    # outage buffer of the node publisher: batches held while the broker is unreachable
    max_buffered_batches: int = Field(10_000, gt=0)
    max_buffered_events: int = Field(5_000_000, gt=0)
    # the actuators' checks (kvguard.actuators.actuator): a command issued further ahead of the
    # node's clock than the skew, or valid for longer than the TTL cap, is rejected
    command_max_skew_s: float = Field(60.0, ge=0)
    command_max_ttl_s: float = Field(3600.0, gt=0)
    # the applied-command journal (one file per GPU; "~" expands); null keeps it in memory only
    journal_dir: str | None = "~/.kvguard/journal"

    @field_validator("node_id")
    @classmethod
    def _node_id(cls, value: str | None) -> str | None:
        # what every consumer would refuse at decode is refused here, at start
        problem = None if value is None else node_id_problem(value)
        if problem is not None:
            raise ValueError(f"node id {problem}")
        return value


class ExportSettings(_Section):
    # kvguard export: who pages for an alert (the forwarder to Alertmanager, or the PrometheusRule)
    paging: Literal["forwarder", "prometheus"] = "forwarder"
    max_nodes: int = Field(5000, gt=0)  # per-node state held; records of further nodes are refused, counted
    ttl_s: float = Field(300.0, gt=0)  # a node silent this long (wall time) is dropped, counted
    model_label: str = ""  # the `model` label when ticks carry none


class Settings(BaseSettings):
    model_config = SettingsConfigDict(extra="forbid", validate_assignment=True, env_prefix=ENV_PREFIX,
                                      env_nested_delimiter="__", case_sensitive=False)

    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    topics: TopicsSettings = Field(default_factory=TopicsSettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)
    streams: StreamsSettings = Field(default_factory=StreamsSettings)
    predictor: PredictorSettings = Field(default_factory=PredictorSettings)
    policy: PolicySettings = Field(default_factory=PolicySettings)
    canary: CanarySettings = Field(default_factory=CanarySettings)
    budget: BudgetSettings = Field(default_factory=BudgetSettings)
    node: NodeSettings = Field(default_factory=NodeSettings)
    export: ExportSettings = Field(default_factory=ExportSettings)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        """Only the arguments: the file and the environment come in through ``load``, which knows
        where each value came from and says so in errors."""
        return (init_settings,)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike | None = None,
        *,
        env: Mapping[str, str] | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> "Settings":
        """Defaults < file (``path`` or ``$KVGUARD_CONFIG``) < env ``KVGUARD_*__*`` < ``overrides``.

        ``overrides`` is a nested dict (``{"kafka": {"bootstrap": "h:9092"}}``), e.g. from CLI flags.
        """
        env = os.environ if env is None else env
        data: dict[str, Any] = {}
        sources: dict[tuple[str, ...], str] = {}
        file_path = path if path is not None else env.get(ENV_CONFIG_FILE) or None
        if file_path is not None:
            file_data = _file_values(cls, Path(file_path))
            _merge(data, file_data)
            sources.update(_leaf_sources(file_data, f"file {file_path}"))
        _merge(data, _env_values(cls, env, sources))
        if overrides:
            _merge(data, overrides)
            sources.update(_leaf_sources(overrides, "overrides"))
        return cls.from_dict(data, sources=sources)

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], *, sources: Mapping[tuple[str, ...], str] | None = None
    ) -> "Settings":
        try:
            return cls.model_validate(dict(data))
        except ValidationError as exc:
            raise _config_error(exc, sources or {}) from None


# a file's source by its suffix; any other suffix is read as TOML
_FILE_SOURCES: dict[str, tuple[type, str]] = {".json": (JsonConfigSettingsSource, "JSON"),
                                               ".toml": (TomlConfigSettingsSource, "TOML")}


def _file_values(cls: type[Settings], path: Path) -> dict[str, Any]:
    """The file's values. pydantic-settings skips a file that is not there; a config file that was
    asked for must exist, so that is checked first."""
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise ConfigError("<file>", f"cannot read {path}: {exc.strerror}") from None
    source, kind = _FILE_SOURCES.get(path.suffix.lower(), _FILE_SOURCES[".toml"])
    try:
        return source(cls, path)()
    except OSError as exc:
        raise ConfigError("<file>", f"cannot read {path}: {exc.strerror}") from None
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError("<file>", f"{path} is not valid {kind}: {exc}") from None
    except (ValueError, TypeError):  # the source dict.update()s what it parsed: a JSON list, a number
        raise ConfigError("<file>", f"{path} must hold a table/object at the top level") from None


class _EnvSource(EnvSettingsSource):
    """pydantic-settings' env source over a given mapping (``Settings.load(env=…)``), not only
    ``os.environ``."""

    def __init__(self, settings_cls: type[Settings], environ: Mapping[str, str]):
        self.environ = environ  # read by _load_env_vars during super().__init__
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        # the hook every pydantic-settings env source reads its variables through (the dotenv one overrides it too)
        return {name.lower(): value for name, value in self.environ.items()}


def _env_values(cls: type[Settings], env: Mapping[str, str], sources: dict[tuple[str, ...], str]) -> dict[str, Any]:
    """The values of the ``KVGUARD_<SECTION>__<FIELD>`` variables; each one's path goes into
    ``sources``. Names are checked first: pydantic-settings would silently skip an unknown section."""
    chosen: dict[str, str] = {}
    paths: dict[tuple[str, ...], str] = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        parts = tuple(p.lower() for p in name[len(ENV_PREFIX):].split("__"))
        if any(not p for p in parts):
            raise ConfigError(".".join(parts), "empty name part", f"env {name}")
        if parts[0] not in cls.model_fields:
            raise ConfigError(".".join(parts), "unknown setting", f"env {name}")
        chosen[name] = value
        paths[parts] = f"env {name}"
    for parts, source in paths.items():
        if any(parts[:n] in paths for n in range(1, len(parts))):
            raise ConfigError(".".join(parts), "conflicts with another variable", source)
    if not chosen:
        return {}
    sources.update(paths)
    try:
        return _EnvSource(cls, chosen)()
    except SettingsError:
        raise _env_json_error(cls, chosen) from None


def _env_json_error(cls: type[Settings], chosen: Mapping[str, str]) -> ConfigError:
    """pydantic-settings names only the section whose value did not parse: find the variable."""
    for name, value in chosen.items():
        try:
            _EnvSource(cls, {name: value})()
        except SettingsError as exc:
            field = ".".join(p.lower() for p in name[len(ENV_PREFIX):].split("__"))
            return ConfigError(field, f"not valid JSON: {exc.__cause__ or exc}", f"env {name}")
    return ConfigError("<env>", "a KVGUARD_* value is not valid JSON")


def _merge(into: dict[str, Any], new: Mapping[str, Any]) -> None:
    """Deep merge: a section given by two sources keeps the keys of both (the later one's win)."""
    for key, value in new.items():
        if isinstance(value, Mapping):
            if not isinstance(into.get(key), dict):
                into[key] = {}
            _merge(into[key], value)
        else:
            into[key] = value


def _leaf_sources(data: Mapping[str, Any], label: str, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], str]:
    """``{path: label}`` for every value of ``data`` that is not itself a section."""
    out: dict[tuple[str, ...], str] = {}
    for key, value in data.items():
        path = prefix + (str(key),)
        if isinstance(value, Mapping):
            out.update(_leaf_sources(value, label, path))
        else:
            out[path] = label
    return out


_PROBLEMS = {
    "greater_than_equal": "must be ≥ {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be ≤ {le}",
    "less_than": "must be < {lt}",
    "extra_forbidden": "unknown setting",
    "literal_error": "must be one of {expected}",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_parsing": "must be a number",
    "bool_parsing": "must be true or false",
    "string_too_short": "must not be empty",
    "string_pattern_mismatch": "must match {pattern}",
    "value_error": "{error}",
}


def _config_error(exc: ValidationError, sources: Mapping[tuple[str, ...], str]) -> ConfigError:
    err = exc.errors(include_url=False)[0]
    loc = tuple(str(p) for p in err["loc"])
    template = _PROBLEMS.get(err["type"])
    ctx = {k: (f"{v:g}" if isinstance(v, float) else v) for k, v in (err.get("ctx") or {}).items()}
    problem = template.format(**ctx) if template else err["msg"]
    if len(exc.errors()) > 1:
        problem += f" (and {len(exc.errors()) - 1} more problem(s))"
    source = sources.get(loc)
    if source is None:
        # a whole-section source: the nearest enclosing path with a known origin
        for n in range(len(loc) - 1, 0, -1):
            if loc[:n] in sources:
                source = sources[loc[:n]]
                break
    return ConfigError(".".join(loc) or "<root>", problem, source)
