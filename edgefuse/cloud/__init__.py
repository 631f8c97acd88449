"""Cloud collaboration at decoding time: the cloud LLM service, the device-side link and the
collaborative decoders (speculative decoding, logit fusion). See ``protocol`` for the wire."""
