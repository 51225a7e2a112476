"""The profile cache and the profiler's version: a profile cached by an older version of the
profiler (one that did not time qdot on the codebook types IQ4_NL, IQ4_XS and MXFP4, and so
priced them at Q4_1's rate) is not read by this one, which measures again."""

from __future__ import annotations

from hetero.planner.specs import load_spec
from hetero.profiler import machine as profile


def test_a_profile_of_an_older_version_is_not_read(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    live = profile.live_devices()
    now = profile.fingerprint(live)
    with monkeypatch.context() as m:
        m.setattr(profile, "CACHE_VERSION", 7)  # before the codebook types' rates
        old = profile.fingerprint(live)
    # datasheet numbers stand in for the older measurement: what is tested is the lookup
    stale = [load_spec("desktop-ddr5").replace(id="cpu")]
    assert "qdot:IQ4_XS" not in stale[0].matmul
    profile.save(old, stale, {})
    assert profile.load_cached(old) is not None  # the file is there and readable
    assert old != now and profile.load_cached(now) is None  # this version does not take it
