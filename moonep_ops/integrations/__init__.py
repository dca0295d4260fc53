"""Drop-in integrations of the MoonEP MoE layer into model libraries.

  moonep_ops.integrations.hf              Hugging Face transformers: ``convert_model``,
                                          ``full_state_dict`` (needs ``transformers``;
                                          docs/integrations.md)
  moonep_ops.integrations.torchtitan      torchtitan 0.3.0's MoE models: the ``moonep`` override
                                          (needs ``torchtitan``; docs/integrations.md)

Nothing here is imported by ``import moonep_ops``: each integration imports its library.
torchtitan on a CPU-only torch (tests, examples): moonep_ops.testing.torchtitan_cpu.
"""
