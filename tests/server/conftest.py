import sys
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import serverproc  # noqa: E402
from serverproc import ServerProcess  # noqa: E402

serverproc.FORK_SERVERS = True  # forkserver.py: the imports once per test process


@pytest.fixture(scope="module")
def tiny_server():
    """The seeded tiny model: 4 slots on a pool that fits them all."""
    with ServerProcess(["-np", "4", "-c", "2048"]) as server:
        yield server


@pytest.fixture(scope="session")
def smollm2_server():
    """The real default model, loaded once per session. Decode rows pinned to the GGUF's blocks:
    `--weights auto` measures at start-up and may pick either, and tests compare this server's
    bytes with other servers'."""
    with ServerProcess(["-np", "4", "-c", "4096", "--weights", "gguf"],
                       model="builtin://smollm2-135m") as server:
        yield server


@pytest.fixture(scope="session")
def smollm2_openai(smollm2_server):
    """The real `openai` client on the shared SmolLM2 server."""
    return openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused", max_retries=0)
