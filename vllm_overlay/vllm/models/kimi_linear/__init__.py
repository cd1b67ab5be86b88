# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Model-owned code for KimiLinearForCausalLM (Kimi Delta Attention + MLA + MoE)."""
