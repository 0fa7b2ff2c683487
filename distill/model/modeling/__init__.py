"""The exported student's own HuggingFace modeling code, one self-contained pair of files per family.

``configuration_distill_<family>.py`` + ``modeling_distill_<family>.py`` are copied verbatim into
every exported student directory and named in its ``config.json``'s ``auto_map``, so the
student loads with ``trust_remote_code=True`` where distill is not installed. They import
torch and transformers only (never distill): a test holds them to that. distill's
replacements (``distill.replacements``) are built on the same classes and kernels, so the
module that trained is the module that is shipped.

    llama: decoders (Llama, Qwen2, Mistral, Qwen3 teachers), model_type ``distill_llama``
    bert:  encoders (BERT-family teachers), model_type ``distill_bert``
"""
