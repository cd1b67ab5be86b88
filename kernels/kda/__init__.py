# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fused KDA decode step (conv + gate + delta rule + gated RMSNorm) for SM90.

``kernel`` holds the device code, ``prepared`` the per-layer binding and the
graph-capturable launch.  Import those submodules explicitly; this package
does not import cutlass on its own.
"""
