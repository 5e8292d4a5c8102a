package statetables.jvm;

import org.apache.hadoop.fs.FileStatus;
import org.apache.hadoop.fs.LocalFileSystem;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.RawLocalFileSystem;
import org.apache.hadoop.fs.permission.FsPermission;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.attribute.PosixFilePermissions;

/**
 * Hadoop's local file system (`fs.file.impl`) without a process per call. Without Hadoop's native library, which
 * Spark does not ship, RawLocalFileSystem starts a `chmod` for every file and folder it creates with a permission
 * and a `readlink` for each side of every rename (Delta's commits, the streaming checkpoint): about 250 processes in
 * one small micro-batch, each one spawned by a JVM with a 2 GiB heap (profiled). Java's file API answers both
 * inside the JVM. The answers are the same: the same permission bits are set, and a path that is not a symbolic
 * link gets the status Hadoop gives it when `readlink` prints nothing. Links, and permissions with a sticky bit
 * (which the file API cannot set), keep Hadoop's own path.
 */
public class LocalFileSystemWithoutForks extends LocalFileSystem {
    public LocalFileSystemWithoutForks() {
        super(new Raw());
    }

    /** The raw (checksum-less) file system under both this class and {@link LocalFsWithoutForks}. */
    static final class Raw extends RawLocalFileSystem {
        @Override
        public void setPermission(Path path, FsPermission permission) throws IOException {
            if (permission.getStickyBit()) {
                super.setPermission(path, permission);
                return;
            }
            Files.setPosixFilePermissions(pathToFile(path).toPath(), PosixFilePermissions.fromString(
                    permission.getUserAction().SYMBOL + permission.getGroupAction().SYMBOL
                            + permission.getOtherAction().SYMBOL));
        }

        @Override
        public FileStatus getFileLinkStatus(Path path) throws IOException {
            if (Files.isSymbolicLink(pathToFile(path).toPath())) {
                return super.getFileLinkStatus(path);
            }
            return getFileStatus(path);
        }
    }
}
