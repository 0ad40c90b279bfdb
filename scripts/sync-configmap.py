"""Copy deploy/kvguard.toml into the kvguard-config ConfigMap (deploy/k8s/configmap.yaml) verbatim.

Kustomize cannot load files outside its directory, so the ConfigMap carries a copy;
tests/meta/test_deploy.py checks the two are equal. Run after editing deploy/kvguard.toml.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGMAP = ROOT / "deploy" / "k8s" / "configmap.yaml"
MARKER = "  kvguard.toml: |\n"

text = CONFIGMAP.read_text()
head = text[:text.index(MARKER) + len(MARKER)]
body = "".join(f"    {line}" if line.strip() else "\n" for line in (ROOT / "deploy" / "kvguard.toml").read_text()
               .splitlines(keepends=True))
CONFIGMAP.write_text(head + body)
