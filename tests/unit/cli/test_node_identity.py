"""`kvguard node` takes its node ids from settings (node.node_id), so every DaemonSet pod is its own node."""

import subprocess
import sys


def test_node_ids_come_from_the_configured_node_id(tmp_path):
    env = {"KVGUARD_NODE__NODE_ID": "gpu-host-7/gpu0", "KVGUARD_KAFKA__BOOTSTRAP": "127.0.0.1:1",
           "KVGUARD_POLICY__HMAC_SECRET": "00c8cd9036c6d061599a730e35cefd75e8df5a079b2ebfd3-node-identity",
           "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", "from kvguard.cli import main; main()", "node", "--duration", "10s",
                             "--no-actuator"], capture_output=True, text=True, env=env, timeout=120)
    # no broker answers on port 1: the run fails after saying which node it is
    assert "kvguard node gpu-host-7:" in result.stderr, result.stderr
