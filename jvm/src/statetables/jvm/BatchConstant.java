package statetables.jvm;

import org.apache.spark.sql.api.java.UDF1;

import java.nio.ByteBuffer;

/**
 * `statetables_constant(bytes)`: the BIGINT held in 8 big-endian bytes (a BINARY literal), for a micro-batch's own
 * constants: its id, its time, a bound that moves with each batch. Spark writes a literal of a primitive type into
 * the Java source it generates for a stage, so a constant that changes every batch made every batch's stages new
 * code: compiled by Janino, then by the JIT, again each batch. A BINARY literal is passed by reference, and the
 * optimizer does not fold a function call into a literal: the stages' source, and so their compiled classes, stay
 * the same from batch to batch.
 */
public final class BatchConstant implements UDF1<byte[], Long> {
    private static final long serialVersionUID = 1L;

    @Override
    public Long call(byte[] bytes) {
        return bytes == null || bytes.length != Long.BYTES ? null : ByteBuffer.wrap(bytes).getLong();
    }
}
