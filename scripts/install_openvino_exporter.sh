#!/usr/bin/env bash
# Make .venv-openvino, a virtual environment with OpenVINO's exporter (optimum-intel), so
# that `specedge bench --baselines openvino-genai` can make OpenVINO GenAI's own int4 model
# of the bundle's checkpoint. optimum-intel 2.2 pins transformers below 5.6 while specedge's
# export extra takes 5.24, so it cannot share .venv; the bench finds this one's optimum-cli
# (or the one named by SPECEDGE_OPTIMUM_CLI). OpenVINO GenAI's runtime itself comes with the
# peers extra (pip install -e '.[peers]') and has no such pin.
#
#   bash scripts/install_openvino_exporter.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-openvino
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "torch==2.13.0" "optimum-intel[openvino]==2.2.0"
# transformers imports torchvision when it is installed, and a torchvision wheel built for
# another torch build (the CUDA one, against a CPU torch) fails to load; exporting a language
# model needs none of it.
"$VENV/bin/python" -m pip uninstall --quiet --yes torchvision
"$VENV/bin/optimum-cli" export openvino --help >/dev/null
echo "OpenVINO's exporter is in $VENV/bin/optimum-cli; specedge bench finds it there"
