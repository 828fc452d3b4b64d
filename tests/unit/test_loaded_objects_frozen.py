"""The server puts what loading made out of the cyclic collector's sight before it serves."""

import asyncio
import gc
from types import SimpleNamespace

from kvpark.pod.args import parse_args
from kvpark.pod.http.lifecycle import Server


def test_objects_made_while_loading_are_frozen_before_the_engine_starts():
    seen_at_start = []
    engine = SimpleNamespace(start=lambda: seen_at_start.append(gc.get_freeze_count()))
    server = Server(parse_args([]), stack=SimpleNamespace(engine=engine, model_name="m"))
    gc.unfreeze()
    loaded = [[i] for i in range(5000)]  # containers the collector tracks, made "by loading"
    try:
        asyncio.run(server.start())
        assert seen_at_start and seen_at_start[0] >= len(loaded)
        assert gc.get_freeze_count() >= len(loaded)
    finally:
        gc.unfreeze()
