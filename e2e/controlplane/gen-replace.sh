#!/usr/bin/env bash
# Regenerates the replace block of go.mod from k8s.io/kubernetes' own go.mod:
# every "k8s.io/<staging> => ./staging/src/k8s.io/<staging>" becomes a replace
# onto the published staging module at the matching v0.x version.
set -euo pipefail
cd "$(dirname "$0")"
K8S_VERSION="${K8S_VERSION:-v1.36.3}"
STAGING_VERSION="v0.${K8S_VERSION#v1.}"
dir=$(go mod download -json "k8s.io/kubernetes@${K8S_VERSION}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
{
  echo "replace ("
  sed -n 's#^\t\(k8s.io/[a-z0-9-]*\) => ./staging/src/.*#\t\1 => \1 '"${STAGING_VERSION}"'#p' "$dir/go.mod"
  echo ")"
} > replace.gen
grep '^godebug' "$dir/go.mod" > godebug.gen
python3 - <<'PY'
import re
mod = open("go.mod").read()
mod = re.sub(r"(?ms)^// BEGIN generated replace.*?^// END generated replace\n",
             "// BEGIN generated replace (gen-replace.sh)\n" + open("replace.gen").read() + "// END generated replace\n", mod)
mod = re.sub(r"(?m)^godebug .*$", open("godebug.gen").read().strip(), mod)
open("go.mod", "w").write(mod)
PY
rm -f replace.gen godebug.gen
