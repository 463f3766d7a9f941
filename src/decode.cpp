// Placeholder: the recurrent (decode / speculative decode) path is being written.
