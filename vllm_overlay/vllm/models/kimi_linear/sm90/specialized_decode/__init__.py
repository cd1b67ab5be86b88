# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Latency-specialized decode for Kimi-Linear on SM90.

``runtime/`` decides whether a deployment runs it (``decode_backend`` in
additional_config); the CuTe DSL kernels live in ``cutedsl/``, one folder per op family.
"""
