# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Latency-specialized decode for Kimi-Linear on SM90.

The CuTe DSL kernels live in ``cutedsl/``, one folder per op family.
"""
