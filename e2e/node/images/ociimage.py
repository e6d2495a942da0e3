#!/usr/bin/env python3
"""Builds the local node's OCI image tarballs without a registry or a container engine.

    ociimage.py pause   OUT.tar --name N --binary PAUSE
    ociimage.py python  OUT.tar --name N --rootfs DIR [--add SRC=DEST ...] [--workdir W] -- ENTRYPOINT...
    ociimage.py static  OUT.tar --name N --add SRC=DEST ... [--expose PORT ...] [--cmd ARG ...] -- ENTRYPOINT...

`static` is for static binaries (the operator image, release/build): no base but the files
every image has (/tmp, who 65532 is) and what --add names, as the Dockerfile's distroless
static base gives; user 65532.

Each tarball is an OCI image layout (oci-layout, index.json, blobs/) whose index names the
image in the annotation containerd reads (`io.containerd.image.name`), so
`ctr -n k8s.io images import OUT.tar` makes the image known to the CRI plugin under N; a
manifest.json gives the same blobs the docker-archive shape (`docker load`, `kind load
image-archive`).
Layers are plain, uncompressed tars written with fixed owners and times, so the same
inputs give the same digests. Every image runs as the numeric user 65532 (step Pods run
with runAsNonRoot) except pause, which runs as 65535 like the upstream pause image.
"""

import argparse
import hashlib
import io
import json
import os
import stat
import sys
import tarfile

EPOCH = 0


def _info(name, mode, kind=tarfile.REGTYPE, size=0, link=""):
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.mode = mode
    ti.size = size
    ti.linkname = link
    ti.mtime = EPOCH
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = "root"
    return ti


class Layer:
    """An uncompressed layer tar built in memory, directories created on the way."""

    def __init__(self):
        self.buf = io.BytesIO()
        self.tar = tarfile.open(fileobj=self.buf, mode="w", format=tarfile.PAX_FORMAT)
        self.dirs = set()

    def mkdir(self, path, mode=0o755):
        path = path.strip("/")
        if not path or path in self.dirs:
            return
        self.mkdir(os.path.dirname(path))
        self.dirs.add(path)
        self.tar.addfile(_info(path, mode, tarfile.DIRTYPE))

    def file(self, path, data, mode=0o644):
        path = path.strip("/")
        self.mkdir(os.path.dirname(path))
        self.tar.addfile(_info(path, mode, size=len(data)), io.BytesIO(data))

    def symlink(self, path, target):
        path = path.strip("/")
        self.mkdir(os.path.dirname(path))
        self.tar.addfile(_info(path, 0o777, tarfile.SYMTYPE, link=target))

    def tree(self, src, dest):
        """Copies a directory tree (files, symlinks, dirs; modes kept, owners root)."""
        for root, dirs, files in os.walk(src):
            dirs.sort()
            rel = os.path.relpath(root, src)
            base = dest if rel == "." else os.path.join(dest, rel)
            st = os.lstat(root)
            self.mkdir(base, stat.S_IMODE(st.st_mode))
            for name in sorted(dirs + files):
                p = os.path.join(root, name)
                st = os.lstat(p)
                target = os.path.join(base, name)
                if stat.S_ISLNK(st.st_mode):
                    self.symlink(target, os.readlink(p))
                elif stat.S_ISREG(st.st_mode):
                    with open(p, "rb") as f:
                        self.file(target, f.read(), stat.S_IMODE(st.st_mode))
            # walk visits the directories themselves (mkdir above keeps their modes)

    def bytes(self):
        self.tar.close()
        return self.buf.getvalue()


def write_image(out, name, layers, config, arch="amd64"):
    blobs = {}

    def blob(data):
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return digest

    layer_descs = []
    diff_ids = []
    for data in layers:
        d = blob(data)
        diff_ids.append(d)
        layer_descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar",
                            "digest": d, "size": len(data)})
    cfg = json.dumps({
        "architecture": arch,
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": [{"created_by": "e2e/node/images/ociimage.py"} for _ in layers],
    }, sort_keys=True).encode()
    cfg_digest = blob(cfg)
    manifest = json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": cfg_digest, "size": len(cfg)},
        "layers": layer_descs,
    }, sort_keys=True).encode()
    man_digest = blob(manifest)
    index = json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": man_digest, "size": len(manifest),
            "platform": {"architecture": arch, "os": "linux"},
            "annotations": {"io.containerd.image.name": name,
                            "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1]},
        }],
    }, sort_keys=True).encode()

    tmp = out + ".tmp"
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as t:
        def add(path, data):
            t.addfile(_info(path, 0o644, size=len(data)), io.BytesIO(data))
        add("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        add("index.json", index)
        # The docker-archive view of the same blobs (as `docker save` writes since 25):
        # `docker load` and tools that read manifest.json accept the tarball too.
        add("manifest.json", json.dumps([{
            "Config": "blobs/sha256/" + cfg_digest.split(":", 1)[1],
            "RepoTags": [name],
            "Layers": ["blobs/sha256/" + d["digest"].split(":", 1)[1] for d in layer_descs],
        }]).encode())
        for d, data in sorted(blobs.items()):
            add("blobs/sha256/" + d.split(":", 1)[1], data)
    os.replace(tmp, out)
    print(f"{name}: {out} ({sum(len(b) for b in layers) // 1024} KiB of layers)", file=sys.stderr)


def base_files(layer):
    """What every image has: /tmp for any user, and who 65532 is."""
    layer.mkdir("tmp", 0o1777)
    layer.file("etc/passwd", b"root:x:0:0:root:/root:/sbin/nologin\n"
               b"nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n")
    layer.file("etc/group", b"root:x:0:\nnonroot:x:65532:\n")
    layer.mkdir("home/nonroot", 0o755)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["pause", "python", "static"])
    p.add_argument("out")
    p.add_argument("--name", required=True)
    p.add_argument("--arch", default="amd64", choices=["amd64", "arm64"],
                   help="the architecture of the binaries (static images only)")
    p.add_argument("--binary")
    p.add_argument("--rootfs")
    p.add_argument("--add", action="append", default=[], help="SRC=DEST (file or directory)")
    p.add_argument("--workdir", default="/")
    p.add_argument("--env", action="append", default=[])
    p.add_argument("--expose", action="append", default=[], help="a TCP port the image listens on")
    p.add_argument("--cmd", action="append", default=[], help="an argument of CMD")
    argv = sys.argv[1:]
    entrypoint = []
    if "--" in argv:
        i = argv.index("--")
        argv, entrypoint = argv[:i], argv[i + 1:]
    a = p.parse_args(argv)
    a.entrypoint = entrypoint

    if a.kind == "pause":
        layer = Layer()
        with open(a.binary, "rb") as f:
            layer.file("pause", f.read(), 0o755)
        write_image(a.out, a.name, [layer.bytes()],
                    {"Entrypoint": ["/pause"], "User": "65535:65535"})
        return

    app = Layer()
    for spec in a.add:
        src, dest = spec.split("=", 1)
        if os.path.isdir(src):
            app.tree(src, dest)
        else:
            with open(src, "rb") as f:
                app.file(dest, f.read(), stat.S_IMODE(os.stat(src).st_mode))

    if a.kind == "static":
        base = Layer()
        base_files(base)
        config = {"Entrypoint": a.entrypoint, "User": "65532:65532",
                  "Env": ["PATH=/usr/local/bin:/usr/bin:/bin"] + a.env, "WorkingDir": a.workdir}
        if a.cmd:
            config["Cmd"] = a.cmd
        if a.expose:
            config["ExposedPorts"] = {f"{port}/tcp": {} for port in a.expose}
        write_image(a.out, a.name, [base.bytes(), app.bytes()], config, a.arch)
        return

    base = Layer()
    base.tree(a.rootfs, "/")
    base_files(base)
    env = ["PATH=/usr/local/bin:/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE=1",
           "PYTHONUNBUFFERED=1"] + a.env
    write_image(a.out, a.name, [base.bytes(), app.bytes()],
                {"Entrypoint": a.entrypoint, "User": "65532:65532", "Env": env,
                 "WorkingDir": a.workdir})


if __name__ == "__main__":
    main()
