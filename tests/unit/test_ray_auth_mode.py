"""A local Ray cluster of our own starts without Ray's token-auth warning: the mode Ray would pick
(token) is stated before Ray is imported, and never after it (Ray reads it once, at import) nor
over the user's own."""

import os
import subprocess
import sys

import pytest

PROBE = ("import os, sys\n{before}\nfrom asyncrl.launch import state_own_cluster_auth\n"
         "state_own_cluster_auth({address})\nprint(os.environ.get('RAY_AUTH_MODE'))")


@pytest.mark.parametrize("before, address, mode, stated", [
    ("", None, None, "token"),                   # our own cluster, Ray not imported, mode unset: stated
    ("import ray", None, None, "None"),          # too late: the driver would keep its cached mode
    ("", None, "disabled", "disabled"),          # the user's choice stays
    ("", "'10.0.0.1:6379'", None, "None"),       # a cluster of the user's: its own mode, found by Ray
])
def test_the_auth_mode_is_stated_only_before_ray_and_never_over_the_users(before, address, mode, stated):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    if mode is not None:
        env["RAY_AUTH_MODE"] = mode
    out = subprocess.run([sys.executable, "-c", PROBE.format(before=before, address=address)], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == stated
