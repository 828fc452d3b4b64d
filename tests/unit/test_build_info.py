"""What build answers (pod/http/build_info.py): read once, not on every request."""

from kvpark.pod.http import build_info


def test_the_version_is_read_once_and_the_fingerprint_follows_the_numerics(monkeypatch):
    """importlib.metadata scans sys.path for the version (~2 ms on the event loop): a server
    reads it once; the fingerprint still differs with what decides the numbers."""
    reads = []
    monkeypatch.setattr(build_info, "version", lambda name: reads.append(name) or "9.9.9")
    build_info.build_version.cache_clear()
    build_info.fingerprint.cache_clear()
    try:
        first = build_info.fingerprint("cpu|fp32")
        assert build_info.fingerprint("cpu|fp32") == first
        assert build_info.fingerprint("cpu|amx-bf16") != first
        assert build_info.build_version() == "9.9.9" and reads == ["kvpark"]
    finally:  # the real version for the tests after this one
        build_info.build_version.cache_clear()
        build_info.fingerprint.cache_clear()
