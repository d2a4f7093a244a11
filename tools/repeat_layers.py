#!/usr/bin/env python3
"""Lengthens a synthetic moeflux model directory, in place, to N layers whose
later layers reuse its own layers' files.

    python3 tools/repeat_layers.py DIR --layers N [--from F]

A model of L layers keeps its layers below F (default: its first MoE layer,
so leading dense layers stay as they are); layer i >= F takes the tensors
and the expert file of layer F + (i - F) % (L - F). The manifest then
describes a shape of N layers while the disk holds only the L layers'
bytes: a preset too large for a machine's disk (gpt-oss-120b's 65 GB, say)
is benchmarked this way. Every layer is still loaded as tensors and experts
of its own (a GPU holds N layers' weights), and a benchmark of random
weights does not depend on their values; the repeated layers do compute
the same function, so the model is for speed only. config.json, a copy of
the shorter model's configuration, is removed: moeflux reads the
manifest's. Synthetic models only (`moeflux synth`).
"""
import argparse
import json
import os
import sys


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--from", dest="first", type=int, default=None)
    args = parser.parse_args()
    path = os.path.join(args.dir, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    if not manifest.get("synthetic"):
        sys.exit(f"{path}: not a synthetic model (made by `moeflux synth`); refusing to repeat real weights")
    config = manifest["config"]
    have = config["num_hidden_layers"]
    moe_layers = sorted(e["layer"] for e in manifest["experts"])
    first = args.first if args.first is not None else (moe_layers[0] if moe_layers else 0)
    if not 0 <= first < have:
        sys.exit(f"--from {first}: must be a layer of the model (0 to {have - 1})")
    if args.layers <= have:
        sys.exit(f"--layers {args.layers}: the model already has {have} layers")
    period = have - first

    def source(i):
        return i if i < first else first + (i - first) % period

    prefixes = {f"layers.{j}.": j for j in range(first, have)}
    added = {}
    for name, tensor in manifest["tensors"].items():
        for prefix, j in prefixes.items():
            if name.startswith(prefix):
                rest = name[len(prefix):]
                for i in range(have, args.layers):
                    if source(i) == j:
                        added[f"layers.{i}.{rest}"] = tensor
    manifest["tensors"].update(added)
    experts = {e["layer"]: e for e in manifest["experts"]}
    for i in range(have, args.layers):
        if source(i) in experts:
            manifest["experts"].append(dict(experts[source(i)], layer=i))
    config["num_hidden_layers"] = args.layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = [config["layer_types"][source(i)] for i in range(args.layers)]
    if "first_k_dense_replace" in config and config["first_k_dense_replace"] > first:
        sys.exit("--from: the leading dense layers must stay below the repeated ones")
    manifest["files"] = [f for f in manifest["files"] if f["path"] != "config.json"]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f)
    os.replace(tmp, path)
    config_file = os.path.join(args.dir, "config.json")
    if os.path.exists(config_file):
        os.remove(config_file)
    repeated = sum(1 for i in range(have, args.layers) if source(i) in experts)
    print(f"{args.dir}: {args.layers} layers over the files of {have} "
          f"(layers {first}.. repeat with period {period}; {repeated} more MoE layers)")


if __name__ == "__main__":
    main()
