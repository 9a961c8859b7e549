"""mkdocs hook: the plots under ``benchmarks/results/`` go into the site.

The pages link to a plot where it lies in the repository (``../benchmarks/results/x.png``),
so the link works on the repository's own file view too.  That folder is outside ``docs/``;
this hook adds each of its PNGs to the site's files under that same link target, copied to
``results/`` in the built site, so ``mkdocs build --strict`` resolves the link.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files, InclusionLevel

RESULTS = Path(__file__).resolve().parent / "benchmarks" / "results"


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for png in sorted(RESULTS.glob("*.png")):
        uri = f"../benchmarks/results/{png.name}"
        plot = File.generated(config, uri, abs_src_path=str(png), inclusion=InclusionLevel.INCLUDED)
        plot.dest_uri = f"results/{png.name}"
        files.append(plot)
    return files
