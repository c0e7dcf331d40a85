"""DNN: the speaker-adapted filterbank front end (stage 7), the frame data module, Strom's sigmoid DNN
and the comparison of trained runs."""
