"""colibri.toml parsing, environment overrides and validation errors (colibri_backend.config)."""

from __future__ import annotations

from pathlib import Path

import pytest

from colibri_backend.config import (
    DEFAULT_BACKEND,
    DEFAULT_MODEL,
    ConfigError,
    load_config,
    parse_size,
)

SAMPLE = """
backend = "llama_cpp"
model = "small"

[server]
host = "0.0.0.0"
port = 9000
api_key = "sk-file"
max_queue = 4

[models.small]
path = "weights/small.gguf"
threads = 2
context_length = 1024
memory_budget = "1.5G"
chat_template = "tmpl.jinja"

[models.small.options]
n_batch = 64

[models.big]
path = "/abs/big.gguf"
backend = "colibri"
"""


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory and XDG dir with no colibri.toml, and no COLIBRI_* variables."""
    import os

    for key in list(os.environ):
        if key.startswith("COLIBRI_") and key not in ("COLIBRI_LIB", "COLIBRI_CACHE"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    return tmp_path


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_without_a_file(isolated: Path) -> None:
    cfg = load_config(env={})
    assert cfg.source is None
    assert cfg.backend == DEFAULT_BACKEND == "colibri"
    assert cfg.default_model == DEFAULT_MODEL == "smollm2"
    m = cfg.model()
    assert (m.alias, m.path, m.backend) == ("smollm2", "smollm2", "colibri")
    assert cfg.server.host == "127.0.0.1"


def test_full_file(isolated: Path) -> None:
    conf_dir = isolated / "conf"
    write(conf_dir / "tmpl.jinja", "{% for m in messages %}{{ m.content }}{% endfor %}")
    f = write(conf_dir / "colibri.toml", SAMPLE)
    cfg = load_config(f, env={})
    assert cfg.source == f
    assert cfg.backend == "llama_cpp" and cfg.default_model == "small"
    small = cfg.model()
    assert small.path == str((conf_dir / "weights/small.gguf").resolve())  # relative to the file
    assert small.backend == "llama_cpp"  # the file's default backend
    assert (small.threads, small.context_length) == (2, 1024)
    assert small.memory_budget == int(1.5 * 2**30)
    assert small.chat_template.startswith("{% for m in messages %}")
    assert small.options == {"n_batch": 64}
    big = cfg.model("big")
    assert big.backend == "colibri" and big.path == "/abs/big.gguf" and big.threads is None
    assert (cfg.server.host, cfg.server.port, cfg.server.api_key, cfg.server.max_queue) == (
        "0.0.0.0",
        9000,
        "sk-file",
        4,
    )


def test_file_found_through_env_cwd_and_xdg(isolated: Path) -> None:
    write(isolated / "xdg" / "colibri" / "colibri.toml", 'backend = "transformers"\n')
    assert load_config(env={"XDG_CONFIG_HOME": str(isolated / "xdg")}).backend == "transformers"
    write(isolated / "colibri.toml", 'backend = "llama_cpp"\n')  # ./colibri.toml wins over XDG
    assert load_config(env={"XDG_CONFIG_HOME": str(isolated / "xdg")}).backend == "llama_cpp"
    other = write(isolated / "elsewhere.toml", 'backend = "colibri"\n[models.a]\npath = "smollm2"\n')
    cfg = load_config(env={"COLIBRI_CONFIG": str(other)})  # $COLIBRI_CONFIG wins over ./colibri.toml
    assert cfg.backend == "colibri" and cfg.default_model == "a" and cfg.model().path == "smollm2"
    with pytest.raises(ConfigError, match="COLIBRI_CONFIG"):
        load_config(env={"COLIBRI_CONFIG": str(isolated / "missing.toml")})


def test_environment_overrides(isolated: Path) -> None:
    f = write(isolated / "colibri.toml", SAMPLE.replace('chat_template = "tmpl.jinja"\n', ""))
    env = {
        "COLIBRI_BACKEND": "colibri",
        "COLIBRI_THREADS": "3",
        "COLIBRI_CONTEXT_LENGTH": "256",
        "COLIBRI_MEMORY_BUDGET": "512M",
        "COLIBRI_API_KEY": "sk-env",
    }
    cfg = load_config(f, env=env)
    for alias in ("small", "big"):  # COLIBRI_BACKEND switches every alias, whatever the file says
        m = cfg.model(alias)
        assert (m.backend, m.threads, m.context_length, m.memory_budget) == ("colibri", 3, 256, 512 * 2**20)
    assert cfg.server.api_key == "sk-env"
    assert load_config(f, env={"COLIBRI_MODEL": "big"}).model().alias == "big"
    gguf = write(isolated / "x" / "My-Model.Q8_0.gguf", "")
    cfg = load_config(f, env={"COLIBRI_MODEL": str(gguf), "COLIBRI_BACKEND": "llama_cpp"})
    m = cfg.model()
    assert (m.alias, m.path, m.backend) == ("My-Model.Q8_0", str(gguf.resolve()), "llama_cpp")


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[models.a]\npath = "x.gguf"\nthreads = "two"\n', "models.a.threads"),
        ('[models.a]\npath = "x.gguf"\nthreads = 0\n', "models.a.threads"),
        ('[models.a]\npath = "x.gguf"\ncontext_length = 1.5\n', "models.a.context_length"),
        ('[models.a]\npath = "x.gguf"\nmemory_budget = "lots"\n', "models.a.memory_budget"),
        ('[models.a]\npath = "x.gguf"\nbackend = 3\n', "models.a.backend"),
        ('[models.a]\npath = "x.gguf"\ncolour = "red"\n', "models.a.colour"),
        ("[models.a]\nthreads = 2\n", "models.a.path"),
        ('[models.a]\npath = "x.gguf"\noptions = 3\n', "models.a.options"),
        ('[models.a]\npath = "x.gguf"\nchat_template = "nope.jinja"\n', "models.a.chat_template"),
        ("models = 3\n", "models"),
        ("[server]\nport = 70000\n", "server.port"),
        ('[server]\nmax_queue = "many"\n', "server.max_queue"),
        ('[server]\nbind = "x"\n', "server.bind"),
        ('backend = ["a"]\n', "backend"),
        ('modle = "a"\n', "modle"),
        ('model = "b"\n[models.a]\npath = "x.gguf"\n', "model"),
    ],
)
def test_errors_name_the_key(isolated: Path, text: str, key: str) -> None:
    f = write(isolated / "colibri.toml", text)
    with pytest.raises(ConfigError) as info:
        load_config(f, env={})
    msg = str(info.value)
    assert str(f) in msg and f"{key}:" in msg, msg


def test_invalid_toml_and_env_values(isolated: Path) -> None:
    f = write(isolated / "bad.toml", "backend = \n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(f, env={})
    with pytest.raises(ConfigError, match="COLIBRI_THREADS: expected an integer"):
        load_config(env={"COLIBRI_THREADS": "many"})
    with pytest.raises(ConfigError, match="COLIBRI_CONTEXT_LENGTH: must be between"):
        load_config(env={"COLIBRI_CONTEXT_LENGTH": "2"})
    with pytest.raises(ConfigError, match="COLIBRI_MEMORY_BUDGET"):
        load_config(env={"COLIBRI_MEMORY_BUDGET": "-1G"})


def test_parse_size() -> None:
    assert parse_size(1234) == 1234
    assert parse_size("1.5G") == 1610612736
    assert parse_size("512MiB") == parse_size("512M") == parse_size("512mb") == 512 << 20
    assert parse_size("64k") == 65536
    assert parse_size("100") == 100
    # One parser for every size setting (colibri_backend.budget): 0 means no limit, as on the CLI.
    assert parse_size(0) == parse_size("0") == parse_size("unlimited") == 0
    for bad in ("", "G", "1.5X", "-3", -1, True, 1.5):
        with pytest.raises(ConfigError):
            parse_size(bad)
