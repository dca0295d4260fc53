"""Drop-in integrations of the MoonEP MoE layer into model libraries.

  moonep_ops.integrations.hf   Hugging Face transformers: ``convert_model``, ``full_state_dict``
                               (needs ``transformers``; docs/integrations.md)

Nothing here is imported by ``import moonep_ops``: each integration imports its library.
"""
